"""What the `specdec` measuring commands run and write: bench and sweep, microbench, doctor and
profile, gate and invariance (with significance.py's statistics), replay, and the vendored
prompts (prompts.py, data/). May import the study's artifacts/, engines/ and present/."""
