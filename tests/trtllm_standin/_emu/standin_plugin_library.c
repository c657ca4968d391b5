/* The stand-in libdflash_trt_plugins.so (tests only): the registration entry point of the
 * real library (plugins/src/trt/plugin_registration.cpp), and a way for the emulated
 * TensorRT registry to ask which namespace the creators were registered under.
 * Same contract: the first call registers under its namespace (NULL means "dflash");
 * a later call succeeds only with the same namespace. */
#include <stdbool.h>
#include <string.h>

static char g_namespace[256];
static bool g_registered = false;

bool initDFlashPlugins(void* logger, const char* libNamespace)
{
    (void) logger;
    const char* ns = libNamespace != NULL ? libNamespace : "dflash";
    if (g_registered)
    {
        return strcmp(g_namespace, ns) == 0;
    }
    strncpy(g_namespace, ns, sizeof(g_namespace) - 1);
    g_registered = true;
    return true;
}

const char* standin_registered_namespace(void)
{
    return g_registered ? g_namespace : NULL;
}
