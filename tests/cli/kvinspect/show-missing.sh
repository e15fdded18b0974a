kvinspect show nope.kvc
