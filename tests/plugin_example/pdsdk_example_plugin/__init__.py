"""A third-party pdsdk plugin, as small as one can be."""
