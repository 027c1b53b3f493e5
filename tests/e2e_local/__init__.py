"""End-to-end tests of a local fleet (a package, so its fleet fixture ends with the folder)."""
