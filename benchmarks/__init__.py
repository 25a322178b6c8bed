"""autopart's benchmarks: each compares autopart with a named peer; ``python -m benchmarks``
runs them all and prints one table of ratios."""
