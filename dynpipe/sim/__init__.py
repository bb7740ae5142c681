"""Simulators: tools that drive the runtime's adaptation policies against an exact oracle
on hundreds of scenarios drawn from measured profiles and recorded run logs. Not runtime:
nothing under ``dynpipe.runtime`` imports them.

| module | job |
|---|---|
| ``simulator`` | one pipeline: the policy against the per-phase oracle and the clairvoyant floor |
| ``replica_simulator`` | the same for the replica policy over random dp x pp scenarios |

Data paths (profiles, run logs, a predictor) are passed in; the command lines' defaults are
relative to the repository root, where they are run from.
"""
