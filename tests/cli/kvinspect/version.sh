kvinspect --version
