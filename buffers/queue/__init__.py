"""Between generation and training: the token-length-bucketed replay queue, the admission
gate that bounds staleness, and the accounting of what they drop."""
