"""Static unrolling of chunk-sequential loops and graph-size budgeting.

Not built yet: see the project's open issue on static unrolling. Today the
chunked GLA reaches the inner compiler already as straight-line code, because
`chunked_gla` is traced with a static chunk count.
"""
