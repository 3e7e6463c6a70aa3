"""laminae.recipes: published model designs assembled from laminae.primitives."""
__all__: list[str] = []
