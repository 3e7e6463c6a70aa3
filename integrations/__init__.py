"""laminae.integrations: bridges from laminae's blocks to other libraries.

Each submodule imports its library only when it is imported itself (an optional
extra, e.g. ``pip install laminae[transformers]``); importing laminae, or this
package, imports none of them."""
