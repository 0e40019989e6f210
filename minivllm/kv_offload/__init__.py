"""KV offloading (chapter 13): a second tier of KV blocks behind the paged pool, in memory and in files."""
