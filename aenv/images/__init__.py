"""OCI images on demand: registry client, layer conversion, chunk cache, lazy FUSE root filesystems."""
