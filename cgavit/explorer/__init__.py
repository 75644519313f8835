"""The CGA Explorer (seed chapter 8): a small web page over cascaded group attention.

:mod:`.compute` turns requests into numbers with the package's own
:class:`~cgavit.attention.CascadedGroupAttention`; :mod:`.server` serves them as JSON beside the
static page in ``static/``, within the bounds of :mod:`.limits` and answering only requests that
pass :mod:`.guard` (Host and Origin). ``cgavit explore`` (:mod:`cgavit.cli.explore`) starts it.
Head similarity is :func:`cgavit.analysis.heads.map_similarity`, the analyses' own definition.
"""

from .compute import ImageAttention, ToyCGA, build_model
from .limits import Limits
from .server import ExplorerServer, make_server

__all__ = ["ExplorerServer", "ImageAttention", "Limits", "ToyCGA", "build_model", "make_server"]
