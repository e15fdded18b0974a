kvserve-once --version
