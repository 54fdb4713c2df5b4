"""vengine C ABI: the cffi embedding build (capi.build) and its Python side (capi._impl)."""
