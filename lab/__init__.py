"""The lab: experiments beside the library (lab/README.md). Not the library, not in CI, may be
deleted; run from the repository root (``python -m lab.probes.<name>``)."""
