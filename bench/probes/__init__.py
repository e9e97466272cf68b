"""One-question GPU probes; bench/probes/README.md lists each with its results file."""
