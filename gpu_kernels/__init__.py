"""GPU kernels (CUDA C through CuPy, loaded by ``launch``) and their NumPy twins
(``reference``); ``abi`` is the ring contract. Importing this package never imports CuPy."""
