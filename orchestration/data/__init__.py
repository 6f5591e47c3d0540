"""Data: text sources, built-in corpora and tasks, tokenization and packing, sampling.

Modules: texts (load_texts: files, JSONL, datasets folders, built-in sources), corpora
(corpus:prose, corpus:python, corpus:locales), tasks (synthetic exact-match tasks), tokens (tokenizers,
packing into fixed-length rows, the token cache) and sampling (TokenDataset, splits,
shards, batch order).
"""
