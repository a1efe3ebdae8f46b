"""The record: how one chunk is stored in every tier and checked on every read.

`keys` (what names a chunk), `encoding` (header, checksum, the layout of a record), `codec` (payload compression).
The lowest layer above `errors`: it imports nothing else of tiercache."""
