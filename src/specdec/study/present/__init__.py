"""What the study's artifacts say, read back: scan.py reads a directory of artifacts, figures.py
and report.py draw and tabulate them, sessions.py the multi-turn table, fmt.py formats every
number. Imports the study's artifacts/ at most, never run/: a figure is drawn from files alone."""
