from vktrain.import_noise import silence_known_import_noise

silence_known_import_noise()  # before torchao or executorch can be imported through any vktrain module
