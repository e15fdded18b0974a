kvinspect diff only-one.kvc
