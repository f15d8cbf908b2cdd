"""KV layouts: how each attention backend lays out paged KV, and the copies between paged KV and chunks."""
