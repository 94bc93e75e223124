"""The Ray shell: the only code outside ``workers/`` that imports ray.

Starts Ray and the actors, adapts actor handles to the control plane's protocols, routes
the workers' output. It decides nothing about the run."""
