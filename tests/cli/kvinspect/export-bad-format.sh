kvinspect export --to npz a.kvc -o a.npz
