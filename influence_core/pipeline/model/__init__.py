"""Model construction and the built-in architectures: building, training and storing models, the transformer, losses."""
