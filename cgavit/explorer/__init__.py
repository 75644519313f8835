"""The CGA Explorer (seed chapter 8): a small web page over cascaded group attention.

:mod:`.compute` turns requests into numbers with the package's own
:class:`~cgavit.attention.CascadedGroupAttention`; :mod:`.server` serves them as JSON beside the
static page in ``static/`` and registers the ``cgavit explore`` command.
"""

from .compute import ImageAttention, ToyCGA, head_similarity

__all__ = ["ImageAttention", "ToyCGA", "head_similarity"]
