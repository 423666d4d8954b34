"""The GLA operators and their mathematics: `laplace::gla` (the token recurrence, the reference),
the chunked form and its explicit backward (the chunk-loop ops), the recurrent form for short sites;
and `laplace::add_scaled`, torch.add with a tensor alpha, for optimizer steps compiled once (scaled_add.py).
Imports only `laplace_passes.infra`."""
