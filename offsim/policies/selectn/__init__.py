"""Select-N (arXiv 2502.08182): the offloading-interval policy (``policy``), its offline performance record
(``record``) and the coordinator that shares one PCIe link between instances (``coordinator``)."""
