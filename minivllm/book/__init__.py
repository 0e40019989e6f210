"""Code only the book uses: the generators and simulations of chapters 2-5, the texts, the harnesses of the
exercise checks. It may import the engine; the engine never imports it."""
