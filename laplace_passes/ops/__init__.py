"""The GLA operators and their mathematics: `laplace::gla` (the token recurrence, the reference),
the chunked form and its explicit backward (the chunk-loop ops), the recurrent form for short sites.
Imports only `laplace_passes.infra`."""
