"""The stage bodies, one module per stage: data, training, curvature, index, query factors, aggregation, LDS, MAGIC."""
