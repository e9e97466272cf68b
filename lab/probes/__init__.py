"""One-question GPU probes; lab/probes/README.md lists each with its results file."""
