"""Fuzzing dsq's readers with hostile files: `python -m dsq.fuzz --help`.

Seeds (seeds.py) are small valid files dsq makes itself; mutators (mutate.py) damage them the
ways downloads and attackers do; targets (targets.py) run them through dsq's readers in this
process, or through the CLI in child processes (cli_target.py). Each input ends clean (it loads,
or dsq refuses it with its own error), or is a finding: a crash (a signal), a hang (past the time
limit) or an internal error (an exception that is not dsq's). Findings are saved under
tests/regressions/ and replayed by tests/test_hostile_regressions.py.
"""
