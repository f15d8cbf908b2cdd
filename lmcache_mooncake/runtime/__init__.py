"""Process helpers: child processes, CPU affinity, heap and malloc settings, prefaulting."""
