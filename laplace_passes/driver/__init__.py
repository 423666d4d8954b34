"""The driver: the `laplace` backend, `compile` / `inspect` / `preflight` / `export_stablehlo`, the
options of a compile, the declared pipeline of passes, shapes, and AOT Autograd in between.

    backend -> compile_fx -> pipeline -> run_passes -> inner compiler

Sits above the passes and the lowering compilers, which it names; nothing below imports it."""
