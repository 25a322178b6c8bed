"""Frontend: where a model enters. ``capture`` exports an unmodified model (and its loss) to
one functional FX graph; ``cost`` annotates it with symbolic FLOPs/bytes; ``shapes``
re-propagates shapes after a pass; ``spec`` loads a model from a ``file.py:make`` SPEC."""
