"""The composition layer: :class:`Parallel3D` builds a dp x tp x pp (x cp) mesh over the layers below it;
``replicas`` puts each data-parallel mode behind one interface; ``universal_checkpoint`` saves and loads a
run on any layout."""
