"""The demo: a GLA language model trained on multi-query associative recall with sharded Muon
(`laplace-passes demo`), its checkpoints, and the local multi-process launcher it uses."""
