"""TensorRT-LLM (engine backend) integration of DFlash / DDTree."""
