"""Models handed back to the runtimes people deploy with (CTranslate2), built from hprune's models."""
