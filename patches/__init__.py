"""hotspare_patches: version-checked shims for host frameworks (this directory, installed under
that name). Each is applied by one explicit ``apply()`` call, never at import."""
