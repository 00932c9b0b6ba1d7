"""Named compositions of drafters for the method registry (`speculation/methods.py`):
`auto` over its named components, and the LongSpec methods with their retrieval
drafters and shipped weights. They compose drafters, so they live above them."""
