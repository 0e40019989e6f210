"""Tools around the book and the engine: the notebook exporter, benchmarks, the load generator, the GPU check,
the tiny model's training script. They may import the engine; the engine never imports them."""
