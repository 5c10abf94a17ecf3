"""A model's weights on a node's disk: pulled from the hub or copied from a peer (whose manifest is
checked first), kept within the disk budget, and served to peers by the file server."""
