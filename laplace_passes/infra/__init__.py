"""Pass infrastructure, below every pass: the pass base and its runner, fake values and graph
helpers, op facts, hardware targets, the report, logging, output directories, the inner-compiler
interface. Imports nothing else of laplace_passes."""
