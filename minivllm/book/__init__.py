"""Code only the book uses: the generators and simulations of chapters 2-5, the cache autopsy of chapter 7,
the texts. It may import the engine; the engine never imports it."""
