"""The CGA Explorer (design notes, chapter 8): a small web page over cascaded group attention.

One module per job: :mod:`.toy` (six tokens through the package's own
:class:`~cgavit.attention.CascadedGroupAttention`), :mod:`.loading` (the model behind the image
panel), :mod:`.uploads` (uploads opened by :mod:`cgavit.images` within the explorer's bounds),
:mod:`.image_attention` (a real model's maps of an upload), :mod:`.grids` (window boxes and the
per-token grids the page draws). :mod:`.server` serves them as JSON beside the static page in
``static/``, within the bounds of :mod:`.limits` and answering only requests that pass
:mod:`.guard` (Host and Origin). ``cgavit explore`` (:mod:`cgavit.cli.explore`) starts it. Head
similarity is :func:`cgavit.analysis.heads.map_similarity`, the analyses' own definition.
"""

from .image_attention import ImageAttention
from .limits import Limits
from .loading import build_model
from .server import ExplorerServer, make_server
from .toy import ToyCGA

__all__ = ["ExplorerServer", "ImageAttention", "Limits", "ToyCGA", "build_model", "make_server"]
