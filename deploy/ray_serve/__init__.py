"""prefix-router inside Ray Serve: our policies as a Serve request router, our engines as a
Serve application (docs/ray_serve.md)."""
