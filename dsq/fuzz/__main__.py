"""python -m dsq.fuzz --help (dsq/fuzz/run.py)."""

from dsq.fuzz.run import main

main()
