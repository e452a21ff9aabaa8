"""Analysis: measured cases and their re-simulation (``validate``), committed results (``results``), traces step by
step (``timeline``), policy decisions (``decisions``) and drawing (``plots``)."""
