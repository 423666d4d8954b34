"""What users run around a compile: the `laplace-passes` command line and the report dump."""
