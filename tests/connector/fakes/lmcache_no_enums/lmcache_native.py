"""FAKE lmcache_native without the enums."""

Bitmap = object
