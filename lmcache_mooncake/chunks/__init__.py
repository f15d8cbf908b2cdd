"""Chunk identity and format: namespaces, chained content keys, object and file names, the chunk header and checksum."""
